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
import { DashboardRenderer } from './dashboardRenderer';
import { asSaved, DASHBOARD_MIME, liveHtml } from './snapshot';

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
