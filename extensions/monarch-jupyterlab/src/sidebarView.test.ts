import { describe, expect, it, vi } from 'vitest';
import {
  fmtBytes,
  fmtDuration,
  fmtPct,
  humanShape,
  IKernelState,
  IMeshState,
  MAX_RANKS_SHOWN,
  IRankRow,
  ISidebarActions,
  renderDashboard,
  renderSidebar,
  summaryText
} from './sidebarView';

function row(rank: number, over: Partial<IRankRow> = {}): IRankRow {
  return {
    rank, pid: 100 + rank, kind: 'idle', text: 'idle', exitcode: null, cpu: 10 * rank,
    rss: (rank + 1) * 1024 ** 3, mem_total: 64 * 1024 ** 3, mem_limit: null, gpu_util: null,
    gpu_mem: null, gpu_mem_total: null, where: null, function: null, debug_in_cell: false,
    ...over
  };
}

function mesh(over: Partial<IMeshState> = {}): IMeshState {
  return {
    name: 'mesh', shape: { hosts: 2, procs: 2 }, size: 4, status: 'live', current: true,
    hosts: [
      { host: 'node-a', ranks: [row(0), row(1, { kind: 'running', text: 'running cell In[3]' })] },
      {
        host: 'node-b',
        ranks: [
          row(2, { kind: 'paused', text: 'paused at Cell In[3], line 4', cpu: 0, where: 'Cell In[3], line 4', function: 'step' }),
          row(3, { kind: 'dead', text: 'dead (exit code 7)', exitcode: 7, cpu: null, rss: null })
        ]
      }
    ],
    ...over
  };
}

function state(meshes: IMeshState[]): IKernelState {
  return { type: 'state', seq: 1, interval: 1, current: 'mesh', meshes };
}

function actions(): ISidebarActions & { calls: unknown[][] } {
  const calls: unknown[][] = [];
  return {
    calls,
    restart: vi.fn((m: string, r: number) => calls.push(['restart', m, r])),
    stop: vi.fn((m: string) => calls.push(['stop', m])),
    dashboard: vi.fn((m: string) => calls.push(['dashboard', m])),
    debug: vi.fn((m: IMeshState, r: IRankRow) => calls.push(['debug', m.name, r.rank]))
  };
}

describe('formatting', () => {
  it('writes bytes, percentages and shapes for people', () => {
    expect(fmtBytes(1536)).toBe('1.5 KiB');
    expect(fmtBytes(512)).toBe('512 B');
    expect(fmtBytes(3 * 1024 ** 3)).toBe('3.0 GiB');
    expect(fmtBytes(null)).toBe('');
    expect(fmtPct(12.34)).toBe('12%');
    expect(fmtPct(3.21)).toBe('3.2%');
    expect(fmtPct(null)).toBe('');
    expect(humanShape({ hosts: 1, procs: 4 })).toBe('1 host x 4 procs');
    expect(humanShape({})).toBe('no ranks');
  });
});

describe('renderSidebar', () => {
  it('lists meshes, ranks grouped by host, and each rank state', () => {
    const node = document.createElement('div');
    renderSidebar(node, state([mesh()]), actions());
    expect(node.querySelector('.mk-sb-mesh-name')!.textContent).toBe('mesh');
    expect(node.querySelector('.mk-sb-shape')!.textContent).toContain('2 hosts x 2 procs');
    const hosts = [...node.querySelectorAll<HTMLElement>('.mk-sb-host')].map(h => h.dataset.host);
    expect(hosts).toEqual(['node-a', 'node-b']);
    const kinds = [...node.querySelectorAll<HTMLElement>('.mk-sb-rank')].map(r => r.dataset.kind);
    expect(kinds).toEqual(['idle', 'running', 'paused', 'dead']);
    const texts = [...node.querySelectorAll('.mk-sb-state-text')].map(e => e.textContent);
    expect(texts).toEqual(['idle', 'running cell In[3]', 'paused at Cell In[3], line 4', 'dead (exit code 7)']);
    expect(summaryText(mesh())).toBe('4 ranks: 1 running, 1 paused, 1 idle, 1 dead');
    // CPU and memory of live ranks; none for the dead one; no GPU column without GPUs
    const r1 = node.querySelector('.mk-sb-rank[data-rank="1"]')!;
    expect(r1.querySelector('.mk-sb-cpu')!.textContent).toBe('cpu 10%');
    expect(r1.querySelector('.mk-sb-mem')!.textContent).toBe('mem 2.0 GiB');
    expect(node.querySelector('.mk-sb-rank[data-rank="3"] .mk-sb-cpu')).toBeNull(); // dead
    expect(node.querySelector('.mk-sb-gpu')).toBeNull();
    // memory is drawn against the largest rank when there is no cgroup limit: rank 2 is the largest
    const fill = node.querySelector<HTMLElement>('.mk-sb-rank[data-rank="2"] .mk-sb-mem-bar .mk-sb-bar-fill')!;
    expect(fill.style.width).toBe('100%');
  });

  it('shows a GPU column only when some rank has a GPU', () => {
    const m = mesh();
    m.hosts[0].ranks[0] = row(0, { gpu_util: 55, gpu_mem: 2 * 1024 ** 3, gpu_mem_total: 80 * 1024 ** 3 });
    const node = document.createElement('div');
    renderSidebar(node, state([m]), actions());
    expect(node.querySelector('.mk-sb-rank[data-rank="0"] .mk-sb-gpu')!.textContent).toBe('gpu 55%');
    expect(node.querySelectorAll('.mk-sb-gpu')).toHaveLength(3); // (not for the dead rank)
  });

  it('calls back for restart, stop, dashboard and debug', () => {
    const a = actions();
    const node = document.createElement('div');
    renderSidebar(node, state([mesh()]), a);
    node.querySelector<HTMLButtonElement>('.mk-sb-rank[data-rank="1"] .mk-sb-restart')!.click();
    node.querySelector<HTMLButtonElement>('.mk-sb-stop')!.click();
    node.querySelector<HTMLButtonElement>('.mk-sb-dashboard')!.click();
    // only paused ranks have a debug button
    expect(node.querySelectorAll('.mk-sb-debug')).toHaveLength(1);
    node.querySelector<HTMLButtonElement>('.mk-sb-rank[data-rank="2"] .mk-sb-debug')!.click();
    expect(a.calls).toEqual([['restart', 'mesh', 1], ['stop', 'mesh'], ['dashboard', 'mesh'], ['debug', 'mesh', 2]]);
  });

  it('lists at most MAX_RANKS_SHOWN ranks of a big mesh, plus the paused and dead ones', () => {
    const ranks = Array.from({ length: 200 }, (_, i) => row(i));
    ranks[150] = row(150, { kind: 'dead', text: 'dead (exit code 1)', cpu: null, rss: null });
    const big = mesh({ size: 200, shape: { procs: 200 }, hosts: [{ host: 'h', ranks }] });
    const node = document.createElement('div');
    renderSidebar(node, state([big]), actions());
    const listed = [...node.querySelectorAll<HTMLElement>('.mk-sb-rank')].map(e => Number(e.dataset.rank));
    expect(listed).toHaveLength(MAX_RANKS_SHOWN + 1);
    expect(listed).toContain(150);
    expect(node.querySelector('.mk-sb-more')!.textContent).toContain(`${200 - MAX_RANKS_SHOWN - 1} more ranks`);
  });

  it('says when there is no mesh, and shows a note', () => {
    const node = document.createElement('div');
    renderSidebar(node, state([]), actions(), 'hello');
    expect(node.querySelector('.mk-sb-note')!.textContent).toBe('hello');
    expect(node.querySelector('.mk-sb-empty')!.textContent).toContain('%mesh spawn 4');
    renderSidebar(node, null, actions());
    expect(node.children).toHaveLength(0);
  });
});

describe('renderDashboard', () => {
  it('draws a row per rank and a totals row', () => {
    const node = document.createElement('div');
    renderDashboard(node, mesh(), 'mesh');
    expect(node.querySelectorAll('.mk-db-rank')).toHaveLength(4);
    const totals = node.querySelector('.mk-db-totals')!.textContent!;
    expect(totals).toContain('3 of 4 reporting');
    expect(totals).toContain('10%'); // 0 + 10 + 0 (rank 2 paused), rank 3 dead
    renderDashboard(node, null, 'gone');
    expect(node.textContent).toContain('Mesh gone is not running');
  });
});

describe('durable meshes', () => {
  it('shows the name, "durable" and the keep-alive the kernel sends', () => {
    expect(fmtDuration(42)).toBe('42s');
    expect(fmtDuration(3900)).toBe('1h 05m');
    expect(fmtDuration(null)).toBe('');
    const node = document.createElement('div');
    renderSidebar(node, state([mesh({ name: 'train', detached: true, keep_alive: 3600 }),
      mesh({ name: 'plain', detached: false, keep_alive: null })]), actions());
    const train = node.querySelector('[data-mesh="train"]') as HTMLElement;
    expect(train.querySelector('.mk-sb-mesh-name')?.textContent).toBe('train');
    const badge = train.querySelector('.mk-sb-durable') as HTMLElement;
    expect(badge.textContent).toBe('durable · keep-alive 1h 00m');
    expect(badge.title).toContain('%mesh attach train');
    const plain = node.querySelector('[data-mesh="plain"]') as HTMLElement;
    expect(plain.querySelector('.mk-sb-durable')).toBeNull();
  });
});
