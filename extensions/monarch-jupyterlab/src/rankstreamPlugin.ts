// Tells each monarch kernel of a notebook that this frontend renders rank output: a comm
// to monarch.rankstream (the kernel then sends it as application/vnd.monarch.rankstream+json;
// without this, plain "[r]" streams). Again after every kernel restart or change.
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel } from '@jupyterlab/services';
import { RANKSTREAM_COMM_TARGET, RANKSTREAM_MIME } from './rankstream';

/** The kernel_info implementation name of the monarch kernel. */
export const MONARCH_IMPLEMENTATION = 'monarch_kernel';

async function announce(
  kernel: Kernel.IKernelConnection,
  done: WeakSet<Kernel.IKernelConnection>
): Promise<void> {
  if (done.has(kernel) || kernel.isDisposed) {
    return;
  }
  done.add(kernel);
  try {
    const info = await kernel.info;
    if (info.implementation !== MONARCH_IMPLEMENTATION) {
      return;
    }
    const comm = kernel.createComm(RANKSTREAM_COMM_TARGET);
    comm.open({ mimetypes: [RANKSTREAM_MIME] });
  } catch (e) {
    done.delete(kernel);
    console.warn('monarch-kernel-jupyterlab: could not announce rank output', e);
  }
}

export const rankstreamPlugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-kernel-jupyterlab:rankstream-announce',
  description: 'Tells monarch kernels that this frontend renders rank output',
  autoStart: true,
  requires: [INotebookTracker],
  activate: (_app: JupyterFrontEnd, tracker: INotebookTracker) => {
    const done = new WeakSet<Kernel.IKernelConnection>();
    const watched = new WeakSet<Kernel.IKernelConnection>();
    const watch = (kernel: Kernel.IKernelConnection | null | undefined) => {
      if (!kernel) {
        return;
      }
      if (!watched.has(kernel)) {
        watched.add(kernel);
        // A restart keeps the connection but drops the kernel's comms: announce again.
        kernel.statusChanged.connect((k, status) => {
          if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
            done.delete(k);
          } else if (status === 'idle') {
            void announce(k, done);
          }
        });
      }
      void announce(kernel, done);
    };
    const follow = (panel: NotebookPanel) => {
      const ctx = panel.sessionContext;
      ctx.kernelChanged.connect((_, change) => watch(change.newValue));
      void ctx.ready.then(() => watch(ctx.session?.kernel));
    };
    tracker.widgetAdded.connect((_, panel) => follow(panel));
    tracker.forEach(panel => follow(panel));
  }
};
