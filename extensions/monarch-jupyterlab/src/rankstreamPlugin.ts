import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';

export const rankstreamPlugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-kernel-jupyterlab:rankstream-announce',
  description: 'Tells monarch kernels that this frontend renders rank output',
  autoStart: true,
  activate: (_app: JupyterFrontEnd) => {
    /* filled in with the rank-output renderer */
  }
};
