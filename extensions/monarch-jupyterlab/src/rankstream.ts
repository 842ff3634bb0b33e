// Rank output of %%mesh cells (application/vnd.monarch.rankstream+json): pure DOM logic,
// no JupyterLab imports, so the unit tests need only jsdom.
//
// The kernel (monarch_kernel/kernel/rankstream.py) sends a cell's output as displays
// ("parts") that share a cell id: parts of lines, each {ranks, stream, text}, and one part
// of progress bars, one per (rank, stream). Here: a colour per rank (CSS variables of
// style/rankstream.css, one set per theme), identical lines of several ranks shown once with
// their ranks (click to expand them per rank), progress bars ordered by rank, and a rank
// filter (all / one / a set) shared by every part of a cell.

export const RANKSTREAM_MIME = 'application/vnd.monarch.rankstream+json';
export const RANKSTREAM_COMM_TARGET = 'monarch.rankstream';

/** Colours of the palette (style/rankstream.css: --jp-monarch-rank-0 .. -N). */
export const RANK_COLOUR_COUNT = 10;

export interface IRankLine {
  ranks: number[];
  stream: string;
  text: string;
}

export interface IRankBar {
  rank: number;
  stream: string;
  text: string;
  done?: boolean;
}

export interface IRankStreamPayload {
  version: number;
  cell: string;
  part: number;
  ranks: number[];
  lines?: IRankLine[];
  progress?: IRankBar[];
}

/** The CSS colour of a rank: a theme variable, so light and dark themes each get theirs. */
export function colourForRank(rank: number): string {
  const n = RANK_COLOUR_COUNT;
  const i = ((Math.trunc(rank) % n) + n) % n;
  return `var(--jp-monarch-rank-${i})`;
}

/** Ranks as people write them: [0,1,2,3,5] -> "0-3, 5" (as the kernel's compact_ranks). */
export function compactRanks(ranks: Iterable<number>): string {
  const sorted = Array.from(new Set(ranks)).sort((a, b) => a - b);
  const out: string[] = [];
  let i = 0;
  while (i < sorted.length) {
    let j = i;
    while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) {
      j++;
    }
    out.push(j === i ? `${sorted[i]}` : `${sorted[i]}-${sorted[j]}`);
    i = j + 1;
  }
  return out.join(', ');
}

/** Reads a payload defensively: anything malformed becomes an empty part. */
export function parsePayload(data: unknown): IRankStreamPayload {
  const d = (data && typeof data === 'object' ? data : {}) as Record<string, unknown>;
  const nums = (v: unknown): number[] =>
    Array.isArray(v) ? v.filter(x => typeof x === 'number') : [];
  const lines = Array.isArray(d.lines)
    ? (d.lines as Record<string, unknown>[])
        .filter(l => l && typeof l === 'object')
        .map(l => ({
          ranks: nums(l.ranks),
          stream: String(l.stream ?? 'stdout'),
          text: String(l.text ?? '')
        }))
    : undefined;
  const progress = Array.isArray(d.progress)
    ? (d.progress as Record<string, unknown>[])
        .filter(b => b && typeof b === 'object' && typeof b.rank === 'number')
        .map(b => ({
          rank: b.rank as number,
          stream: String(b.stream ?? 'stderr'),
          text: String(b.text ?? ''),
          done: Boolean(b.done)
        }))
    : undefined;
  return {
    version: typeof d.version === 'number' ? d.version : 1,
    cell: typeof d.cell === 'string' ? d.cell : '',
    part: typeof d.part === 'number' ? d.part : 0,
    ranks: nums(d.ranks),
    lines,
    progress
  };
}

/**
 * A line joins an earlier identical line (same text and stream) of other ranks when none of
 * its ranks printed anything in between, so every rank's own order is kept (the kernel's
 * folding rule, applied again across its bursts): one line with the union of the ranks.
 */
export function foldLines(lines: IRankLine[]): IRankLine[] {
  const out: IRankLine[] = [];
  for (const line of lines) {
    let target: IRankLine | null = null;
    for (let i = out.length - 1; i >= 0; i--) {
      const prev = out[i];
      if (line.ranks.some(r => prev.ranks.includes(r))) {
        break; // one of its ranks printed this (or something later): no earlier place
      }
      if (prev.text === line.text && prev.stream === line.stream) {
        target = prev;
        break;
      }
    }
    if (target) {
      target.ranks = [...target.ranks, ...line.ranks].sort((a, b) => a - b);
    } else {
      out.push({ ...line, ranks: [...line.ranks].sort((a, b) => a - b) });
    }
  }
  return out;
}

/** Which ranks a cell's output shows: null = all. */
export type RankSelection = ReadonlySet<number> | null;

/**
 * Rank filters by cell id, shared by every display of that cell (its parts are separate
 * outputs); listeners hear about changes of their cell.
 */
export class FilterStore {
  get(cell: string): RankSelection {
    return this._sel.get(cell) ?? null;
  }

  set(cell: string, sel: RankSelection): void {
    if (sel === null || sel.size === 0) {
      this._sel.delete(cell);
    } else {
      this._sel.set(cell, new Set(sel));
    }
    for (const fn of Array.from(this._listeners.get(cell) ?? [])) {
      fn(this.get(cell));
    }
  }

  /** Chip semantics: from "all", a rank shows only it; then ranks toggle in and out. */
  toggle(cell: string, rank: number): void {
    const cur = this.get(cell);
    if (cur === null) {
      this.set(cell, new Set([rank]));
      return;
    }
    const next = new Set(cur);
    if (next.has(rank)) {
      next.delete(rank);
    } else {
      next.add(rank);
    }
    this.set(cell, next.size ? next : null);
  }

  subscribe(cell: string, fn: (sel: RankSelection) => void): () => void {
    let set = this._listeners.get(cell);
    if (!set) {
      set = new Set();
      this._listeners.set(cell, set);
    }
    set.add(fn);
    return () => {
      const s = this._listeners.get(cell);
      s?.delete(fn);
      if (s && s.size === 0) {
        this._listeners.delete(cell);
      }
    };
  }

  private _sel = new Map<string, Set<number>>();
  private _listeners = new Map<string, Set<(sel: RankSelection) => void>>();
}

/** The filters of this page (every notebook of a JupyterLab window). */
export const filters = new FilterStore();

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  e.className = cls;
  if (text !== undefined) {
    e.textContent = text;
  }
  return e;
}

function rankTag(ranks: number[]): HTMLElement {
  const tag = el('span', 'jp-monarch-rs-tag', `[${compactRanks(ranks)}]`);
  if (ranks.length === 1) {
    tag.style.color = colourForRank(ranks[0]);
  }
  return tag;
}

function lineNode(line: IRankLine): HTMLElement {
  const row = el('div', 'jp-monarch-rs-line');
  row.dataset.ranks = line.ranks.join(',');
  row.dataset.stream = line.stream;
  if (line.stream === 'stderr') {
    row.classList.add('jp-mod-stderr');
  }
  if (line.ranks.length === 1) {
    row.dataset.rank = String(line.ranks[0]);
    row.style.borderLeftColor = colourForRank(line.ranks[0]);
    row.append(rankTag(line.ranks), el('span', 'jp-monarch-rs-text', line.text));
    return row;
  }
  // Identical lines of several ranks: shown once, the ranks as dots; click to expand.
  row.classList.add('jp-mod-folded');
  const head = el('div', 'jp-monarch-rs-folded-head');
  head.setAttribute('role', 'button');
  head.tabIndex = 0;
  head.setAttribute('aria-expanded', 'false');
  head.title = `${line.ranks.length} ranks printed this line; click to show each`;
  const dots = el('span', 'jp-monarch-rs-dots');
  for (const r of line.ranks.slice(0, 16)) {
    const dot = el('span', 'jp-monarch-rs-dot');
    dot.dataset.rank = String(r);
    dot.style.backgroundColor = colourForRank(r);
    dots.appendChild(dot);
  }
  head.append(
    el('span', 'jp-monarch-rs-tag', `[${compactRanks(line.ranks)}]`),
    dots,
    el('span', 'jp-monarch-rs-text', line.text)
  );
  const body = el('div', 'jp-monarch-rs-expanded');
  body.hidden = true;
  for (const r of line.ranks) {
    body.appendChild(lineNode({ ranks: [r], stream: line.stream, text: line.text }));
  }
  const toggle = () => {
    body.hidden = !body.hidden;
    row.classList.toggle('jp-mod-expanded', !body.hidden);
    head.setAttribute('aria-expanded', String(!body.hidden));
  };
  head.addEventListener('click', toggle);
  head.addEventListener('keydown', ev => {
    if (ev.key === 'Enter' || ev.key === ' ') {
      ev.preventDefault();
      toggle();
    }
  });
  row.append(head, body);
  return row;
}

function barNode(bar: IRankBar): HTMLElement {
  const row = el('div', 'jp-monarch-rs-bar');
  row.dataset.rank = String(bar.rank);
  row.dataset.ranks = String(bar.rank);
  row.dataset.stream = bar.stream;
  if (bar.done) {
    row.classList.add('jp-mod-done');
  }
  row.style.borderLeftColor = colourForRank(bar.rank);
  row.append(rankTag([bar.rank]), el('span', 'jp-monarch-rs-text', bar.text));
  return row;
}

function toolbar(payload: IRankStreamPayload, store: FilterStore): HTMLElement {
  const bar = el('div', 'jp-monarch-rs-toolbar');
  bar.setAttribute('role', 'toolbar');
  bar.setAttribute('aria-label', 'Show the output of these ranks');
  bar.appendChild(el('span', 'jp-monarch-rs-toolbar-label', 'Ranks:'));
  const all = el('button', 'jp-monarch-rs-chip jp-mod-all', 'All');
  all.dataset.rank = 'all';
  all.title = 'Show every rank';
  all.addEventListener('click', () => store.set(payload.cell, null));
  bar.appendChild(all);
  for (const r of payload.ranks) {
    const chip = el('button', 'jp-monarch-rs-chip', String(r));
    chip.dataset.rank = String(r);
    chip.style.setProperty('--jp-monarch-chip-colour', colourForRank(r));
    chip.title = `Show rank ${r} (again: add or remove it)`;
    chip.addEventListener('click', () => store.toggle(payload.cell, r));
    bar.appendChild(chip);
  }
  return bar;
}

/** Shows and hides the rows of `node` for a selection; returns the rows left visible. */
export function applyFilter(node: HTMLElement, sel: RankSelection): number {
  let visible = 0;
  node.querySelectorAll<HTMLElement>('.jp-monarch-rs-toolbar .jp-monarch-rs-chip').forEach(c => {
    const rank = c.dataset.rank;
    const on = rank === 'all' ? sel === null : sel !== null && sel.has(Number(rank));
    c.classList.toggle('jp-mod-active', on);
    c.setAttribute('aria-pressed', String(on));
  });
  const rows = node.querySelectorAll<HTMLElement>(
    ':scope > .jp-monarch-rs-body > .jp-monarch-rs-line, :scope > .jp-monarch-rs-body > .jp-monarch-rs-bar'
  );
  rows.forEach(row => {
    const ranks = (row.dataset.ranks ?? '').split(',').filter(s => s !== '').map(Number);
    const shown = sel === null ? ranks : ranks.filter(r => sel.has(r));
    row.hidden = shown.length === 0;
    if (!row.hidden) {
      visible++;
    }
    if (row.classList.contains('jp-mod-folded')) {
      const tag = row.querySelector<HTMLElement>('.jp-monarch-rs-folded-head > .jp-monarch-rs-tag');
      if (tag) {
        tag.textContent = `[${compactRanks(shown.length ? shown : ranks)}]`;
      }
      row.querySelectorAll<HTMLElement>('.jp-monarch-rs-dot').forEach(dot => {
        dot.hidden = sel !== null && !sel.has(Number(dot.dataset.rank));
      });
      row.querySelectorAll<HTMLElement>('.jp-monarch-rs-expanded > .jp-monarch-rs-line').forEach(
        sub => {
          sub.hidden = sel !== null && !sel.has(Number(sub.dataset.rank));
        }
      );
    }
  });
  node.dataset.filter = sel === null ? 'all' : compactRanks(sel);
  return visible;
}

/**
 * Renders one display of rank output into `node` (its children are replaced) and keeps it
 * in step with the cell's filter in `store`. Returns a function that stops listening.
 */
export function renderRankStream(
  node: HTMLElement,
  data: unknown,
  store: FilterStore = filters
): () => void {
  const payload = parsePayload(data);
  node.textContent = '';
  node.classList.add('jp-monarch-rankstream');
  node.dataset.cell = payload.cell;
  node.dataset.part = String(payload.part);
  // The first display of a cell carries the filter (it applies to all of them).
  if (payload.part === 0 && payload.ranks.length > 1) {
    node.appendChild(toolbar(payload, store));
  }
  const body = el('div', 'jp-monarch-rs-body');
  if (payload.lines) {
    for (const line of foldLines(payload.lines)) {
      body.appendChild(lineNode(line));
    }
  }
  if (payload.progress) {
    const bars = [...payload.progress].sort(
      (a, b) => a.rank - b.rank || a.stream.localeCompare(b.stream)
    );
    body.classList.add('jp-mod-progress');
    for (const bar of bars) {
      body.appendChild(barNode(bar));
    }
  }
  node.appendChild(body);
  applyFilter(node, store.get(payload.cell));
  return store.subscribe(payload.cell, sel => applyFilter(node, sel));
}
