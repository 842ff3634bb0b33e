// The mesh sidebar's drawing: pure DOM, no JupyterLab imports (unit-tested under jsdom).
//
// It draws the `state` messages the kernel sends on comm target `monarch.mesh`
// (monarch_kernel/kernel/sidebar.py): meshes, ranks grouped by host, each rank's state,
// CPU, memory and GPU, with the buttons that call back into src/sidebar.ts.

export const COMM_TARGET = 'monarch.mesh';
/** Ranks a mesh lists in the sidebar, at most (plus paused and dead ones). */
export const MAX_RANKS_SHOWN = 64;

export type RankKind =
  | 'idle'
  | 'running'
  | 'endpoint'
  | 'paused'
  | 'dead'
  | 'starting'
  | 'stopped';

export interface IRankRow {
  rank: number;
  pid: number | null;
  kind: RankKind;
  text: string;
  exitcode: number | null;
  cpu: number | null;
  rss: number | null;
  mem_total: number | null;
  mem_limit: number | null;
  gpu_util: number | null;
  gpu_mem: number | null;
  gpu_mem_total: number | null;
  where: string | null;
  function: string | null;
  debug_in_cell: boolean;
}

export interface IMeshState {
  name: string;
  shape: Record<string, number>;
  size: number;
  status: string;
  current: boolean;
  /** a durable mesh (`%mesh spawn --detach`): it outlives the kernel */
  detached?: boolean;
  /** seconds a durable mesh waits for a kernel once detached (null: not durable) */
  keep_alive?: number | null;
  hosts: { host: string; ranks: IRankRow[] }[];
}

export interface IKernelState {
  type: 'state';
  seq: number;
  interval: number;
  current: string | null;
  meshes: IMeshState[];
}

export interface ISidebarActions {
  restart(mesh: string, rank: number): void;
  stop(mesh: string): void;
  dashboard(mesh: string): void;
  debug(mesh: IMeshState, row: IRankRow): void;
}

/** `1536` -> `"1.5 KiB"`; null -> `""`. */
export function fmtBytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !isFinite(n)) {
    return '';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let v = n;
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  if (i === 0) {
    return `${Math.round(v)} B`;
  }
  return `${Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}

/** `42` -> `"42s"`, `600` -> `"10m"`, `3900` -> `"1h 05m"`, `90000` -> `"1d 01h"`
 * (as `%mesh list` writes them); null -> `""`. */
export function fmtDuration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) {
    return '';
  }
  const s = Math.max(0, Math.round(seconds));
  const two = (n: number) => String(n).padStart(2, '0');
  if (s < 60) {
    return `${s}s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)}m` + (s < 600 && s % 60 ? ` ${two(s % 60)}s` : '');
  }
  if (s < 86400) {
    return `${Math.floor(s / 3600)}h ${two(Math.floor((s % 3600) / 60))}m`;
  }
  return `${Math.floor(s / 86400)}d ${two(Math.floor((s % 86400) / 3600))}h`;
}

/** `12.3` -> `"12%"`, `3.21` -> `"3.2%"`; null -> `""`. */
export function fmtPct(p: number | null | undefined): string {
  if (p === null || p === undefined || !isFinite(p)) {
    return '';
  }
  return p >= 10 ? `${p.toFixed(0)}%` : `${p.toFixed(1)}%`;
}

/** A mesh's shape for people: `{hosts: 1, procs: 4}` -> `"1 host x 4 procs"`. */
export function humanShape(shape: Record<string, number>): string {
  const parts = Object.entries(shape).map(([name, n]) => {
    const one = n === 1 && name.endsWith('s') && !name.endsWith('ss');
    return `${n} ${one ? name.slice(0, -1) : name}`;
  });
  return parts.length ? parts.join(' x ') : 'no ranks';
}

/** What a rank's memory is measured against: its cgroup limit, else the largest rank. */
export function memLimit(mesh: IMeshState, row: IRankRow): number | null {
  if (row.mem_limit) {
    return row.mem_limit;
  }
  let largest = 0;
  for (const h of mesh.hosts) {
    for (const r of h.ranks) {
      largest = Math.max(largest, r.rss ?? 0);
    }
  }
  return largest || null;
}

export function hasGpu(mesh: IMeshState): boolean {
  return mesh.hosts.some(h =>
    h.ranks.some(r => r.gpu_util !== null || r.gpu_mem !== null)
  );
}

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  if (cls) {
    e.className = cls;
  }
  if (text !== undefined) {
    e.textContent = text;
  }
  return e;
}

function button(cls: string, text: string, title: string, onClick: () => void): HTMLButtonElement {
  const b = el('button', `jp-mod-styled mk-sb-button ${cls}`, text);
  b.title = title;
  b.type = 'button';
  b.onclick = ev => {
    ev.stopPropagation();
    onClick();
  };
  return b;
}

/** A bar with a text on it; `frac` in [0, 1] (null: no bar). */
function bar(frac: number | null, text: string, cls: string, title: string): HTMLElement {
  const wrap = el('div', `mk-sb-bar ${cls}`);
  wrap.title = title;
  const fill = el('div', 'mk-sb-bar-fill');
  fill.style.width = `${Math.round(Math.min(Math.max(frac ?? 0, 0), 1) * 100)}%`;
  wrap.append(fill, el('span', 'mk-sb-bar-text', text));
  return wrap;
}

function rankRow(
  mesh: IMeshState,
  row: IRankRow,
  gpu: boolean,
  actions: ISidebarActions
): HTMLElement {
  // two lines, to fit a narrow sidebar: rank, state and buttons; then the figures as bars
  const div = el('div', `mk-sb-rank mk-kind-${row.kind}`);
  div.dataset.rank = String(row.rank);
  div.dataset.kind = row.kind;
  div.dataset.pid = row.pid === null ? '' : String(row.pid);
  const line = el('div', 'mk-sb-line');
  const state = el('span', 'mk-sb-state');
  state.append(el('span', 'mk-sb-dot'), el('span', 'mk-sb-state-text', row.text));
  state.title =
    row.kind === 'paused' && row.function
      ? `rank ${row.rank} ${row.text}, in ${row.function} (pid ${row.pid ?? '?'})`
      : `rank ${row.rank} ${row.text} (pid ${row.pid ?? '?'})`;
  line.append(el('span', 'mk-sb-r', String(row.rank)), state);
  const act = el('span', 'mk-sb-actions');
  if (row.kind === 'paused') {
    act.append(
      button('mk-sb-debug', 'Debug',
        row.debug_in_cell
          ? `Go to rank ${row.rank}'s debugger prompt in the running cell`
          : `Open the debugger console for rank ${row.rank} (runs %mesh debug in a new cell)`,
        () => actions.debug(mesh, row))
    );
  }
  if (mesh.status === 'live') {
    act.append(
      button('mk-sb-restart', '\u21bb', `Restart rank ${row.rank} with a fresh process`,
        () => actions.restart(mesh.name, row.rank))
    );
  }
  line.append(act);
  div.append(line);
  const figs = el('div', 'mk-sb-figures');
  const live = row.cpu !== null;
  const cpu = el('span', 'mk-sb-cpu');
  const mem = el('span', 'mk-sb-mem');
  if (live) {
    cpu.append(bar((row.cpu ?? 0) / 100, `cpu ${fmtPct(row.cpu)}`, 'mk-sb-cpu-bar', 'CPU, % of one core'));
    const limit = memLimit(mesh, row);
    const what = row.mem_limit ? "of the rank's memory limit" : 'of the largest rank';
    mem.append(
      bar(limit ? (row.rss ?? 0) / limit : null, `mem ${fmtBytes(row.rss)}`, 'mk-sb-mem-bar',
        `resident memory ${fmtBytes(row.rss)}${limit ? `, ${what} (${fmtBytes(limit)})` : ''}`)
    );
  }
  figs.append(cpu, mem);
  if (gpu) {
    const g = el('span', 'mk-sb-gpu');
    if (row.gpu_util !== null || row.gpu_mem !== null) {
      const memText = row.gpu_mem_total
        ? `${fmtBytes(row.gpu_mem)} / ${fmtBytes(row.gpu_mem_total)}`
        : fmtBytes(row.gpu_mem);
      g.append(
        bar((row.gpu_util ?? 0) / 100, `gpu ${fmtPct(row.gpu_util)}`, 'mk-sb-gpu-bar',
          `GPU utilization ${fmtPct(row.gpu_util)}; device memory ${memText}`)
      );
    }
    figs.append(g);
  }
  if (live) {
    div.append(figs);
  }
  return div;
}

/** One mesh: its header (name, shape, buttons) and its ranks, grouped by host. */
export function renderMesh(mesh: IMeshState, actions: ISidebarActions): HTMLElement {
  const sec = el('section', 'mk-sb-mesh');
  sec.dataset.mesh = mesh.name;
  const head = el('div', 'mk-sb-mesh-head');
  const title = el('div', 'mk-sb-mesh-title');
  title.append(
    el('span', 'mk-sb-mesh-name', mesh.name),
    el('span', 'mk-sb-shape', `${humanShape(mesh.shape)}${mesh.current ? ' · current' : ''}`)
  );
  if (mesh.detached) {
    const keep = fmtDuration(mesh.keep_alive);
    const badge = el('span', 'mk-sb-durable', keep ? `durable · keep-alive ${keep}` : 'durable');
    badge.title = `Mesh ${mesh.name} outlives this kernel: shut down or restarted, the kernel ` +
      `detaches it` + (keep ? `, and its ranks wait ${keep} for a kernel to attach ` +
      `(%mesh attach ${mesh.name})` : '');
    title.append(badge);
  }
  const buttons = el('div', 'mk-sb-mesh-buttons');
  buttons.append(
    button('mk-sb-dashboard', 'Dashboard', `Open mesh ${mesh.name}'s dashboard in the main area`,
      () => actions.dashboard(mesh.name)),
    button('mk-sb-stop', 'Stop', `Stop every rank of mesh ${mesh.name}`,
      () => actions.stop(mesh.name))
  );
  head.append(title, buttons);
  sec.append(head, summary(mesh));
  const gpu = hasGpu(mesh);
  // a big mesh: the first MAX_RANKS_SHOWN ranks, and every rank that needs a look
  // (paused, dead) beyond them; the others are counted (the dashboard lists them all)
  let shown = 0;
  let hidden = 0;
  for (const h of mesh.hosts) {
    const ranks = h.ranks.filter(r => {
      const show = shown < MAX_RANKS_SHOWN || r.kind === 'paused' || r.kind === 'dead';
      if (show) {
        shown++;
      } else {
        hidden++;
      }
      return show;
    });
    if (!ranks.length) {
      continue;
    }
    const host = el('div', 'mk-sb-host');
    host.dataset.host = h.host;
    host.append(
      el('div', 'mk-sb-host-name', `${h.host} · ${h.ranks.length} rank${h.ranks.length === 1 ? '' : 's'}`)
    );
    const table = el('div', 'mk-sb-ranks');
    for (const r of ranks) {
      table.append(rankRow(mesh, r, gpu, actions));
    }
    host.append(table);
    sec.append(host);
  }
  if (hidden) {
    sec.append(el('div', 'mk-sb-more', `${hidden} more rank${hidden === 1 ? '' : 's'} not listed: open the Dashboard for every rank`));
  }
  return sec;
}

/** "4 ranks: 2 idle, 1 running, 1 dead". */
export function summaryText(mesh: IMeshState): string {
  const counts = new Map<string, number>();
  for (const h of mesh.hosts) {
    for (const r of h.ranks) {
      counts.set(r.kind, (counts.get(r.kind) ?? 0) + 1);
    }
  }
  const order: RankKind[] = ['running', 'endpoint', 'paused', 'idle', 'starting', 'dead', 'stopped'];
  const parts = order.filter(k => counts.get(k)).map(k => `${counts.get(k)} ${k === 'endpoint' ? 'in endpoints' : k}`);
  return `${mesh.size} rank${mesh.size === 1 ? '' : 's'}: ${parts.join(', ')}`;
}

function summary(mesh: IMeshState): HTMLElement {
  return el('div', 'mk-sb-summary', summaryText(mesh));
}

/** Replace `node`'s content with the sidebar for `state` (null: nothing heard yet). */
export function renderSidebar(
  node: HTMLElement,
  state: IKernelState | null,
  actions: ISidebarActions,
  note = ''
): void {
  node.textContent = '';
  if (note) {
    node.append(el('div', 'mk-sb-note', note));
  }
  if (state === null) {
    return;
  }
  if (!state.meshes.length) {
    node.append(el('div', 'mk-sb-empty', 'No mesh is running. Start one in a cell:  %mesh spawn 4'));
    return;
  }
  for (const m of state.meshes) {
    node.append(renderMesh(m, actions));
  }
}

/** The docked dashboard of one mesh: a row per rank with bars, and a totals row. */
export function renderDashboard(node: HTMLElement, mesh: IMeshState | null, name: string): void {
  node.textContent = '';
  if (mesh === null) {
    node.append(el('div', 'mk-db-gone', `Mesh ${name} is not running (stopped, or the kernel restarted).`));
    return;
  }
  const head = el('div', 'mk-db-head');
  head.append(el('span', 'mk-db-name', `mesh ${mesh.name}`), el('span', 'mk-db-shape', humanShape(mesh.shape)),
    el('span', 'mk-db-summary', summaryText(mesh)));
  node.append(head);
  const gpu = hasGpu(mesh);
  const table = el('table', 'mk-db-table');
  const cols = ['rank', 'host', 'pid', 'state', ...(gpu ? ['gpu', 'gpu memory'] : []), 'cpu', 'memory'];
  const thead = el('tr', 'mk-db-headrow');
  for (const c of cols) {
    thead.append(el('th', '', c));
  }
  table.append(thead);
  let cpu = 0;
  let rss = 0;
  let live = 0;
  for (const h of mesh.hosts) {
    for (const r of h.ranks) {
      const tr = el('tr', `mk-db-rank mk-kind-${r.kind}`);
      tr.dataset.rank = String(r.rank);
      tr.append(el('td', '', String(r.rank)), el('td', '', h.host), el('td', '', r.pid === null ? '' : String(r.pid)));
      const st = el('td', 'mk-db-state');
      st.append(el('span', 'mk-sb-dot'), el('span', '', r.text));
      tr.append(st);
      if (gpu) {
        const g = el('td', '');
        const gm = el('td', '');
        if (r.gpu_util !== null) {
          g.append(bar(r.gpu_util / 100, fmtPct(r.gpu_util), 'mk-sb-gpu-bar', 'GPU utilization'));
        }
        if (r.gpu_mem !== null) {
          gm.append(bar(r.gpu_mem_total ? r.gpu_mem / r.gpu_mem_total : null,
            `${fmtBytes(r.gpu_mem)}${r.gpu_mem_total ? ` / ${fmtBytes(r.gpu_mem_total)}` : ''}`, 'mk-sb-gpu-bar', 'device memory'));
        }
        tr.append(g, gm);
      }
      const c = el('td', '');
      const m = el('td', '');
      if (r.cpu !== null) {
        live++;
        cpu += r.cpu;
        rss += r.rss ?? 0;
        c.append(bar(r.cpu / 100, fmtPct(r.cpu), 'mk-sb-cpu-bar', 'CPU, % of one core'));
        const limit = memLimit(mesh, r);
        m.append(bar(limit ? (r.rss ?? 0) / limit : null, fmtBytes(r.rss), 'mk-sb-mem-bar',
          r.mem_limit ? `of the limit ${fmtBytes(limit)}` : `of the largest rank (${fmtBytes(limit)})`));
      }
      tr.append(c, m);
      table.append(tr);
    }
  }
  const tot = el('tr', 'mk-db-totals');
  tot.append(el('td', '', 'all'), el('td', '', ''), el('td', '', ''),
    el('td', '', `${live} of ${mesh.size} reporting`));
  if (gpu) {
    tot.append(el('td', ''), el('td', ''));
  }
  tot.append(el('td', '', live ? fmtPct(cpu) : ''), el('td', '', live ? fmtBytes(rss) : ''));
  table.append(tot);
  node.append(table);
}
