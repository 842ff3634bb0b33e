// Pure DOM logic of the rank-output renderer: no JupyterLab imports, so the unit tests
// need only jsdom.
export const RANKSTREAM_MIME = 'application/vnd.monarch.rankstream+json';
export const RANKSTREAM_COMM_TARGET = 'monarch.rankstream';

/** Replace node's children with one line per {rank, text} (placeholder). */
export function renderRankStream(node: HTMLElement, data: unknown): void {
  node.textContent = '';
  const lines = Array.isArray(data) ? data : [];
  for (const line of lines as { rank: number; text: string }[]) {
    const div = document.createElement('div');
    div.dataset.rank = String(line.rank);
    div.textContent = `[${line.rank}] ${line.text}`;
    node.appendChild(div);
  }
}
