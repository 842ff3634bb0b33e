// Dashboard outputs that survive (see ./snapshot.ts for the bundle the kernel sends).
//
// 1. A renderer for application/vnd.monarch.dashboard+json, added to each notebook's
//    rendermime registry ahead of ipywidgets' widget-view renderer: it shows the
//    bundle's text/html at once and swaps in the live widget (made by whatever
//    widget-view renderer the registry holds) only when that renders; a widget whose
//    model is gone ("model not found") leaves the static snapshot in place.
// 2. On save, the live dashboard's current drawing replaces the bundle's text/html, so
//    the saved file holds the figures of the moment it was saved.
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Panel, Widget } from '@lumino/widgets';
import {
  asSaved,
  DASHBOARD_MIME,
  liveHtml,
  renderStatic,
  WIDGET_VIEW_MIME,
  widgetOutcome
} from './snapshot';

type Registry = NotebookPanel['content']['rendermime'];

export class DashboardRenderer extends Panel implements IRenderMime.IRenderer {
  constructor(
    options: IRenderMime.IRendererOptions,
    registry: Registry
  ) {
    super();
    this._sanitizer = options.sanitizer;
    this._registry = registry;
    this.addClass('jp-MonarchDashboard');
    this._static = new Widget();
    this._static.addClass('jp-MonarchDashboard-snapshot');
    this.addWidget(this._static);
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const html = model.data['text/html'];
    renderStatic(
      this._static.node,
      html,
      model.trusted ? undefined : h => this._sanitizer.sanitize(h)
    );
    const view = model.data[DASHBOARD_MIME] as { model_id?: string } | undefined;
    const modelId = view?.model_id ?? '';
    if (this._inner && modelId === this._modelId) {
      this._sync(); // the same widget (e.g. new text/html on save): keep its live view
      return;
    }
    this._disposeInner();
    this._modelId = modelId;
    this._sync();
    if (!modelId || !this._registry.getFactory(WIDGET_VIEW_MIME)) {
      return;
    }
    const inner = this._registry.createRenderer(WIDGET_VIEW_MIME);
    inner.addClass('jp-MonarchDashboard-live');
    this._inner = inner;
    this.addWidget(inner);
    this._observer = new MutationObserver(() => this._sync());
    this._observer.observe(inner.node, {
      childList: true,
      subtree: true,
      characterData: true
    });
    this._sync();
    await inner.renderModel({
      trusted: model.trusted,
      data: { [WIDGET_VIEW_MIME]: view as any },
      metadata: {},
      setData: () => undefined
    });
    this._sync();
  }

  /** Show the live widget when it renders, else the static snapshot. */
  private _sync(): void {
    const live =
      this._inner !== null && !this._inner.isDisposed && widgetOutcome(this._inner.node) === 'live';
    this.node.dataset.showing = live ? 'live' : 'snapshot';
    if (live) {
      this._inner!.node.style.display = '';
      this._static.hide();
    } else {
      if (this._inner && !this._inner.isDisposed) {
        this._inner.node.style.display = 'none';
      }
      this._static.show();
    }
  }

  private _disposeInner(): void {
    this._observer?.disconnect();
    this._observer = null;
    if (this._inner && !this._inner.isDisposed) {
      this._inner.dispose();
    }
    this._inner = null;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._disposeInner();
    super.dispose();
  }

  private _sanitizer: IRenderMime.ISanitizer;
  private _registry: Registry;
  private _static: Widget;
  private _inner: IRenderMime.IRenderer | null = null;
  private _modelId = '';
  private _observer: MutationObserver | null = null;
}

/** Put each live dashboard's current drawing into its output's text/html (before a save). */
export function keepLiveDrawings(panel: NotebookPanel): number {
  let n = 0;
  for (const cell of panel.content.widgets) {
    const area = (cell as any).outputArea;
    if (cell.model.type !== 'code' || !area) {
      continue;
    }
    const model = area.model;
    for (let i = 0; i < model.length; i++) {
      const out = model.get(i);
      if (!out.data[DASHBOARD_MIME]) {
        continue;
      }
      const node: HTMLElement | undefined = area.widgets[i]?.node;
      const drawing = node?.querySelector('.jp-MonarchDashboard-live')
        ? liveHtml(node.querySelector('.jp-MonarchDashboard-live') as HTMLElement)
        : null;
      if (drawing) {
        out.setData({ data: { ...out.data, 'text/html': asSaved(drawing) } });
        n++;
      }
    }
  }
  return n;
}

function install(panel: NotebookPanel): void {
  const registry = panel.content.rendermime;
  if (registry.getFactory(DASHBOARD_MIME)) {
    return;
  }
  registry.addFactory(
    {
      safe: false,
      mimeTypes: [DASHBOARD_MIME],
      createRenderer: options => new DashboardRenderer(options, registry)
    },
    -20 // ahead of ipywidgets' widget-view renderer (-10)
  );
  panel.context.saveState.connect((_, state) => {
    if (state === 'started') {
      keepLiveDrawings(panel);
    }
  });
}

export const snapshotPlugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-kernel-jupyterlab:dashboard-snapshot',
  description: 'Keeps the monarch dashboard readable in saved and re-opened notebooks',
  autoStart: true,
  requires: [INotebookTracker],
  activate: (_app: JupyterFrontEnd, tracker: INotebookTracker) => {
    tracker.forEach(install);
    tracker.widgetAdded.connect((_, panel) => install(panel));
  }
};
