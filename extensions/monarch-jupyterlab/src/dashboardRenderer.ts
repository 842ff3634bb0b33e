// The renderer of application/vnd.monarch.dashboard+json (see ./snapshot.ts): the
// bundle's static HTML at once, the live widget (made by the registry's widget-view
// renderer) instead while, and only while, that widget renders. Imports only Lumino and
// types, so the unit tests run it under jsdom with a stand-in registry.
import type { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Panel, Widget } from '@lumino/widgets';
import { DASHBOARD_MIME, renderStatic, WIDGET_VIEW_MIME, widgetOutcome } from './snapshot';

/** What the renderer needs of a rendermime registry. */
export interface IRendererSource {
  getFactory(mimeType: string): IRenderMime.IRendererFactory | undefined;
  createRenderer(mimeType: string): IRenderMime.IRenderer;
}

export class DashboardRenderer extends Panel implements IRenderMime.IRenderer {
  constructor(
    options: IRenderMime.IRendererOptions,
    registry: IRendererSource
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
  private _registry: IRendererSource;
  private _static: Widget;
  private _inner: IRenderMime.IRenderer | null = null;
  private _modelId = '';
  private _observer: MutationObserver | null = null;
}
