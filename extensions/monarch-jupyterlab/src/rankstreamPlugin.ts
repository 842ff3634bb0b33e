// Tells each monarch kernel of a notebook that this frontend renders rank output: a comm
// to monarch.rankstream (the kernel then sends it as application/vnd.monarch.rankstream+json;
// without this, plain "[r]" streams). Again after a kernel restart or change, and again on
// the next idle status when an attempt got no answer. The notebook panel's node carries
// data-monarch-rankstream="on" once the kernel has acknowledged ("off": not a monarch kernel
// or no answer yet).
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel } from '@jupyterlab/services';
import { RANKSTREAM_COMM_TARGET, RANKSTREAM_MIME } from './rankstream';

/** The kernel_info implementation name of the monarch kernel. */
export const MONARCH_IMPLEMENTATION = 'monarch_kernel';

/** Seconds to wait for the kernel's kernel_info reply and for its answer on the comm. */
const ANSWER_TIMEOUT_MS = 15_000;

function within<T>(p: Promise<T>, ms: number, fallback: T): Promise<T> {
  return new Promise<T>(resolve => {
    const t = setTimeout(() => resolve(fallback), ms);
    p.then(
      v => {
        clearTimeout(t);
        resolve(v);
      },
      () => {
        clearTimeout(t);
        resolve(fallback);
      }
    );
  });
}

/** One attempt per kernel connection at a time; the result is kept while it holds. */
const attempts = new WeakMap<Kernel.IKernelConnection, Promise<boolean>>();

async function tryAnnounce(kernel: Kernel.IKernelConnection): Promise<boolean> {
  const reply = await within(kernel.requestKernelInfo(), ANSWER_TIMEOUT_MS, undefined);
  if (!reply) {
    attempts.delete(kernel); // no answer: the next idle status tries again
    return false;
  }
  if ((reply.content as { implementation?: string }).implementation !== MONARCH_IMPLEMENTATION) {
    return false; // another kernel: kept until a restart or change
  }
  const comm = kernel.createComm(RANKSTREAM_COMM_TARGET);
  const acked = new Promise<boolean>(resolve => {
    comm.onMsg = () => resolve(true);
    comm.onClose = () => {
      attempts.delete(kernel);
      resolve(false);
    };
  });
  comm.open({ mimetypes: [RANKSTREAM_MIME] });
  const ok = await within(acked, ANSWER_TIMEOUT_MS, false);
  if (!ok) {
    attempts.delete(kernel);
  }
  return ok;
}

/** Announce to `kernel` unless done or under way; resolves to whether it acknowledged. */
export function announce(kernel: Kernel.IKernelConnection): Promise<boolean> {
  let p = attempts.get(kernel);
  if (!p) {
    p = tryAnnounce(kernel).catch(e => {
      attempts.delete(kernel);
      console.warn('monarch-kernel-jupyterlab: could not announce rank output', e);
      return false;
    });
    attempts.set(kernel, p);
  }
  return p;
}

function follow(panel: NotebookPanel): void {
  const ctx = panel.sessionContext;
  const update = async () => {
    const kernel = ctx.session?.kernel;
    if (!kernel || kernel.isDisposed) {
      return;
    }
    const ok = await announce(kernel);
    if (!panel.isDisposed && ctx.session?.kernel === kernel) {
      panel.node.dataset.monarchRankstream = ok ? 'on' : 'off';
    }
  };
  ctx.kernelChanged.connect(() => {
    delete panel.node.dataset.monarchRankstream;
    void update();
  });
  ctx.statusChanged.connect((_, status) => {
    const kernel = ctx.session?.kernel;
    if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
      // the kernel process and its comms are gone: a new one must be told again
      if (kernel) {
        attempts.delete(kernel);
      }
      delete panel.node.dataset.monarchRankstream;
    } else if (status === 'idle') {
      void update();
    }
  });
  void ctx.ready.then(update);
}

export const rankstreamPlugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-kernel-jupyterlab:rankstream-announce',
  description: 'Tells monarch kernels that this frontend renders rank output',
  autoStart: true,
  requires: [INotebookTracker],
  activate: (_app: JupyterFrontEnd, tracker: INotebookTracker) => {
    tracker.widgetAdded.connect((_, panel) => follow(panel));
    tracker.forEach(panel => follow(panel));
  }
};
