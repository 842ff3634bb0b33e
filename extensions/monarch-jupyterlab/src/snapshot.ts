// Dashboard outputs that survive: pure DOM helpers (no JupyterLab imports, so the unit
// tests need only jsdom). The plugin that uses them is ./snapshotPlugin.ts.
//
// The kernel displays its dashboard as a bundle of
//   application/vnd.monarch.dashboard+json  {model_id, version_major, version_minor}
//   application/vnd.jupyter.widget-view+json (the same; what other frontends render)
//   text/html   the dashboard's last drawing (self-contained, theme variables)
//   text/plain  a summary
// Once the widget's model is gone (the notebook re-opened, the kernel restarted)
// ipywidgets' renderer can only say "Error displaying widget: model not found". This
// extension renders the monarch MIME type instead: the static HTML at once, replaced
// by the live widget if, and only if, the widget manager has the model.

export const DASHBOARD_MIME = 'application/vnd.monarch.dashboard+json';
export const WIDGET_VIEW_MIME = 'application/vnd.jupyter.widget-view+json';
/** Class of the root element of the dashboard's HTML (kernel: ui/snapshot.py). */
export const VIEW_CLASS = 'monarch-dashboard-view';

/** What the widget renderer wrote into `node`: a live view, a failure, or nothing yet. */
export function widgetOutcome(node: HTMLElement): 'live' | 'failed' | 'pending' {
  if (node.querySelector(`.${VIEW_CLASS}`) || node.querySelector('.monarch-dashboard')) {
    return 'live';
  }
  const text = (node.textContent || '').trim();
  if (text.startsWith('Error displaying widget')) {
    return 'failed';
  }
  return 'pending';
}

/** Put the static snapshot `html` into `node` (replacing what was there); `sanitize`
 * is applied first for untrusted outputs. Returns false when there was no HTML. */
export function renderStatic(
  node: HTMLElement,
  html: unknown,
  sanitize?: (html: string) => string
): boolean {
  node.textContent = '';
  if (typeof html !== 'string' || !html) {
    return false;
  }
  node.innerHTML = sanitize ? sanitize(html) : html;
  return true;
}

/** The live dashboard's current drawing in `node` (to keep in the saved file), or null. */
export function liveHtml(node: HTMLElement): string | null {
  const view = node.querySelector(`.${VIEW_CLASS}`);
  return view ? view.outerHTML : null;
}

/** Mark a live drawing as saved: the saved copy says it is the last state seen, not live. */
export function asSaved(html: string, when: Date = new Date()): string {
  const t = when.toTimeString().slice(0, 8);
  return html
    .replace('data-status="live"', 'data-status="saved"')
    .replace(
      /<span class="mk-status">[^<]*<\/span>/,
      `<span class="mk-status">last state seen at ${t} (saved while live)</span>`
    );
}
