// The mesh sidebar: a right-side panel bound to the current notebook's kernel.
//
// It opens a comm to target `monarch.mesh` on that kernel (monarch_kernel/kernel/sidebar.py),
// draws the state the kernel sends every second (src/sidebarView.ts), and sends the actions
// of its buttons: restart a rank, stop a mesh. "Dashboard" docks a live view of one mesh in
// the main area (drawn from the same state); "Debug" on a paused rank goes to its debugger
// prompt: the running cell's prompt when the rank paused in that cell, else a new cell
// running `%mesh debug` (the notebook's own debugger console, where prompts and output stay).
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Dialog, MainAreaWidget, showDialog } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';
import {
  COMM_TARGET,
  IKernelState,
  IMeshState,
  IRankRow,
  ISidebarActions,
  renderDashboard,
  renderSidebar
} from './sidebarView';

const icon = new LabIcon({
  name: 'monarch-kernel-jupyterlab:mesh',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" viewBox="0 0 24 24">' +
    '<g class="jp-icon3" fill="#616161">' +
    '<circle cx="5" cy="5" r="2.5"/><circle cx="19" cy="5" r="2.5"/>' +
    '<circle cx="5" cy="19" r="2.5"/><circle cx="19" cy="19" r="2.5"/>' +
    '<rect x="4" y="4.2" width="16" height="1.6"/><rect x="4" y="18.2" width="16" height="1.6"/>' +
    '<rect x="4.2" y="4" width="1.6" height="16"/><rect x="18.2" y="4" width="1.6" height="16"/>' +
    '</g></svg>'
});

/** The docked dashboard of one mesh, redrawn from every state the sidebar receives. */
class MeshDashboard extends Widget {
  constructor(readonly meshName: string) {
    super();
    this.addClass('mk-dashboard');
  }
  update_(state: IKernelState | null): void {
    const mesh = state?.meshes.find(m => m.name === this.meshName) ?? null;
    renderDashboard(this.node, mesh, this.meshName);
  }
}

export class MeshSidebar extends Widget implements ISidebarActions {
  constructor(private _app: JupyterFrontEnd) {
    super();
    this.id = 'monarch-mesh-sidebar';
    this.addClass('mk-sidebar');
    this.title.icon = icon;
    this.title.caption = 'Monarch meshes';
    this._header = document.createElement('div');
    this._header.className = 'mk-sb-kernel';
    this._status = document.createElement('div');
    this._status.className = 'mk-sb-status';
    this._body = document.createElement('div');
    this._body.className = 'mk-sb-body';
    this.node.append(this._header, this._status, this._body);
    this.setPanel(null);
  }

  /** Follow the notebook `panel` (its kernel, now and after restarts). */
  setPanel(panel: NotebookPanel | null): void {
    this._panel = panel;
    this.setKernel(panel?.sessionContext.session?.kernel ?? null);
  }

  setKernel(kernel: Kernel.IKernelConnection | null): void {
    if (kernel === this._kernel && this._comm && !this._comm.isDisposed) {
      return;
    }
    this._closeComm();
    if (this._kernel) {
      this._kernel.statusChanged.disconnect(this._onStatus, this);
    }
    this._kernel = kernel;
    this._state = null;
    if (!kernel) {
      this._header.textContent = 'No notebook kernel';
      this._header.dataset.kernel = '';
      this._draw('Open a notebook with the Monarch (mesh) kernel to see its meshes.');
      return;
    }
    this._header.textContent = `Kernel: ${kernel.name} (${kernel.id.slice(0, 8)})`;
    this._header.dataset.kernel = kernel.name;
    kernel.statusChanged.connect(this._onStatus, this);
    this._openComm();
  }

  private _onStatus(_: Kernel.IKernelConnection, status: Kernel.Status): void {
    if (
      status === 'restarting' ||
      status === 'autorestarting' ||
      status === 'dead' ||
      (status === 'starting' && this._comm !== null)
    ) {
      this._closeComm();
      this._state = null;
      this._restarted = true;
      this._draw('The kernel is restarting.');
    } else if (status === 'idle' && this._restarted) {
      this._restarted = false;
      this._openComm();
    }
  }

  private _openComm(): void {
    const kernel = this._kernel;
    if (!kernel) {
      return;
    }
    this._draw('Connecting to the kernel…');
    let comm: Kernel.IComm;
    try {
      comm = kernel.createComm(COMM_TARGET);
    } catch (e) {
      this._draw(`Cannot talk to this kernel: ${e}`);
      return;
    }
    this._comm = comm;
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => this._onMsg(msg.content.data as any);
    comm.onClose = () => {
      if (this._comm === comm) {
        this._comm = null;
        this._state = null;
        this._draw(
          'This kernel has no mesh sidebar (it is not a Monarch kernel, or it restarted).'
        );
      }
    };
    comm.open({});
  }

  private _closeComm(): void {
    const comm = this._comm;
    this._comm = null;
    if (comm && !comm.isDisposed) {
      try {
        comm.close();
      } catch {
        /* the kernel is gone */
      }
    }
  }

  private _onMsg(data: any): void {
    if (!data || typeof data !== 'object') {
      return;
    }
    if (data.type === 'state') {
      this._state = data as IKernelState;
      this._draw();
      for (const d of this._dashboards.values()) {
        d.content.update_(this._state);
      }
    } else if (data.type === 'reply') {
      this._setStatus(data.ok ? String(data.message ?? 'done') : String(data.error), !data.ok);
    }
  }

  private _draw(note = ''): void {
    renderSidebar(this._body, this._state, this, note);
  }

  private _setStatus(text: string, error = false): void {
    this._status.textContent = text;
    this._status.classList.toggle('mk-sb-error', error);
  }

  private _send(data: Record<string, unknown>): void {
    if (!this._comm) {
      this._setStatus('Not connected to a Monarch kernel.', true);
      return;
    }
    this._comm.send({ ...data, id: `a${++this._seq}` });
  }

  // ----------------------------------------------------------- actions
  async restart(mesh: string, rank: number): Promise<void> {
    const ok = await showDialog({
      title: `Restart rank ${rank}?`,
      body: `Rank ${rank} of mesh ${mesh} gets a fresh process: its variables are lost, and a cell running on it fails.`,
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Restart' })]
    });
    if (ok.button.accept) {
      this._setStatus(`Restarting rank ${rank} of mesh ${mesh}…`);
      this._send({ action: 'restart', mesh, rank });
    }
  }

  async stop(mesh: string): Promise<void> {
    const ok = await showDialog({
      title: `Stop mesh ${mesh}?`,
      body: `Every rank of mesh ${mesh} is stopped (as %mesh stop does).`,
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
    });
    if (ok.button.accept) {
      this._setStatus(`Stopping mesh ${mesh}…`);
      this._send({ action: 'stop', mesh });
    }
  }

  dashboard(mesh: string): void {
    const key = `${this._kernel?.id ?? ''}:${mesh}`;
    let w = this._dashboards.get(key);
    if (!w || w.isDisposed) {
      const content = new MeshDashboard(mesh);
      w = new MainAreaWidget({ content });
      w.id = `monarch-dashboard-${key.replace(/[^A-Za-z0-9_-]/g, '-')}`;
      w.title.label = `Mesh ${mesh}`;
      w.title.icon = icon;
      w.title.closable = true;
      w.addClass('mk-dashboard-panel');
      this._dashboards.set(key, w);
      w.disposed.connect(() => this._dashboards.delete(key));
      content.update_(this._state);
      this._app.shell.add(w, 'main', { mode: 'split-right' });
    }
    this._app.shell.activateById(w.id);
  }

  debug(mesh: IMeshState, row: IRankRow): void {
    const panel = this._panel;
    if (!panel) {
      return;
    }
    if (row.debug_in_cell) {
      // the running cell already asks for rank R's commands: go to its prompt
      const input = panel.content.node.querySelector<HTMLInputElement>('.jp-Stdin-input');
      if (input) {
        this._app.shell.activateById(panel.id);
        input.scrollIntoView({ block: 'center' });
        input.focus();
        return;
      }
    }
    const use = this._state && this._state.current !== mesh.name ? `%mesh use ${mesh.name}\n` : '';
    const nb = panel.content;
    NotebookActions.insertBelow(nb);
    const cell = nb.activeCell;
    if (!cell) {
      return;
    }
    cell.model.sharedModel.setSource(`${use}%mesh debug`);
    this._app.shell.activateById(panel.id);
    void NotebookActions.run(nb, panel.sessionContext);
    this._setStatus(`Debugger console for rank ${row.rank}: type  attach ${row.rank}  at (mesh-debug)`);
  }

  private _panel: NotebookPanel | null = null;
  private _kernel: Kernel.IKernelConnection | null = null;
  private _comm: Kernel.IComm | null = null;
  private _state: IKernelState | null = null;
  private _restarted = false;
  private _seq = 0;
  private _header: HTMLElement;
  private _status: HTMLElement;
  private _body: HTMLElement;
  private _dashboards = new Map<string, MainAreaWidget<MeshDashboard>>();
}

export const sidebarPlugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-kernel-jupyterlab:mesh-sidebar',
  description: "A sidebar of the notebook kernel's meshes: ranks, states, resources, actions",
  autoStart: true,
  requires: [INotebookTracker],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker) => {
    const panel = new MeshSidebar(app);
    app.shell.add(panel, 'right', { rank: 900 });
    const follow = (nb: NotebookPanel | null) => {
      panel.setPanel(nb);
      nb?.sessionContext.ready.then(() => {
        if (tracker.currentWidget === nb) {
          panel.setPanel(nb);
        }
      });
    };
    tracker.currentChanged.connect((_, nb) => follow(nb));
    tracker.widgetAdded.connect((_, nb) => {
      nb.sessionContext.kernelChanged.connect(() => {
        if (tracker.currentWidget === nb) {
          panel.setPanel(nb);
        }
      });
    });
    follow(tracker.currentWidget);
  }
};
