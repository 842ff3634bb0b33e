import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Widget } from '@lumino/widgets';
import { RANKSTREAM_MIME, renderRankStream } from './rankstream';

export class RankStreamRenderer extends Widget implements IRenderMime.IRenderer {
  constructor(options: IRenderMime.IRendererOptions) {
    super();
    this._mimeType = options.mimeType;
    this.addClass('jp-monarch-rankstream');
  }

  renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    renderRankStream(this.node, model.data[this._mimeType]);
    return Promise.resolve();
  }

  private _mimeType: string;
}

export const rankstreamMimeExtension: IRenderMime.IExtension = {
  id: 'monarch-kernel-jupyterlab:rankstream',
  description: 'Renders the per-rank output of %%mesh cells',
  rendererFactory: {
    safe: true,
    mimeTypes: [RANKSTREAM_MIME],
    createRenderer: options => new RankStreamRenderer(options)
  },
  rank: 0,
  dataType: 'json'
};
