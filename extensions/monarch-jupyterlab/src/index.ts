// Front-end plugins of the monarch kernel extension (package.json "jupyterlab.extension").
//
// Each feature lives in its own module and exports one JupyterFrontEndPlugin (or a list);
// add it to PLUGINS below with a one-line change. The MIME renderers are in ./mime.ts
// (package.json "jupyterlab.mimeExtension").
import { JupyterFrontEndPlugin } from '@jupyterlab/application';
import { rankstreamPlugin } from './rankstreamPlugin';
import { sidebarPlugin } from './sidebar';
import { snapshotPlugin } from './snapshotPlugin';

const PLUGINS: JupyterFrontEndPlugin<any>[] = [
  rankstreamPlugin,
  sidebarPlugin,
  snapshotPlugin,
];

export default PLUGINS;
