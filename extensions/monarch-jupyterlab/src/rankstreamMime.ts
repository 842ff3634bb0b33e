// The MIME renderer of rank output (registered in ./mime.ts).
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Widget } from '@lumino/widgets';
import { filters, RANKSTREAM_MIME, renderRankStream } from './rankstream';

export class RankStreamRenderer extends Widget implements IRenderMime.IRenderer {
  constructor(options: IRenderMime.IRendererOptions) {
    super();
    this._mimeType = options.mimeType;
    this.addClass('jp-monarch-rankstream-output');
  }

  renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    // (an update_display_data renders the same widget again: stop the old listener)
    this._unsubscribe?.();
    this._unsubscribe = renderRankStream(this.node, model.data[this._mimeType], filters);
    return Promise.resolve();
  }

  dispose(): void {
    this._unsubscribe?.();
    this._unsubscribe = null;
    super.dispose();
  }

  private _mimeType: string;
  private _unsubscribe: (() => void) | null = null;
}

export const rankstreamMimeExtension: IRenderMime.IExtension = {
  id: 'monarch-kernel-jupyterlab:rankstream',
  description: 'Renders the per-rank output of %%mesh cells: colours, a rank filter, folding',
  rendererFactory: {
    safe: true,
    mimeTypes: [RANKSTREAM_MIME],
    createRenderer: options => new RankStreamRenderer(options)
  },
  rank: 0,
  dataType: 'json'
};
