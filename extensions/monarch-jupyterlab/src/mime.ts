// MIME renderers of the monarch kernel extension (package.json "jupyterlab.mimeExtension").
//
// Each renderer module exports one IRenderMime.IExtension; add it to EXTENSIONS below.
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { rankstreamMimeExtension } from './rankstreamMime';

const EXTENSIONS: IRenderMime.IExtension[] = [
  rankstreamMimeExtension,
];

export default EXTENSIONS;
