import { describe, expect, it } from 'vitest';
import {
  applyFilter,
  colourForRank,
  compactRanks,
  FilterStore,
  foldLines,
  parsePayload,
  RANK_COLOUR_COUNT,
  renderRankStream
} from './rankstream';

const RANKS = [0, 1, 2, 3];

function linesPayload(part = 0, cell = 'c1') {
  return {
    version: 1,
    cell,
    part,
    ranks: RANKS,
    lines: [
      { ranks: [0, 1, 2, 3], stream: 'stdout', text: 'epoch 1' },
      { ranks: [0], stream: 'stdout', text: 'loss 0.5' },
      { ranks: [1], stream: 'stdout', text: 'loss 0.6' },
      { ranks: [2], stream: 'stderr', text: 'warn' },
      { ranks: [3], stream: 'stdout', text: 'loss 0.7' }
    ]
  };
}

function visible(node: HTMLElement, sel = '.jp-monarch-rs-body > div'): HTMLElement[] {
  return Array.from(node.querySelectorAll<HTMLElement>(sel)).filter(e => !e.hidden);
}

describe('colours', () => {
  it('gives neighbouring ranks different colours and wraps around the palette', () => {
    const c = RANKS.map(colourForRank);
    expect(new Set(c).size).toBe(4);
    expect(colourForRank(RANK_COLOUR_COUNT)).toBe(colourForRank(0));
    expect(colourForRank(-1)).toBe(colourForRank(RANK_COLOUR_COUNT - 1));
    expect(c[0]).toBe('var(--jp-monarch-rank-0)');
  });

  it('colours each single-rank line with its rank and marks stderr', () => {
    const node = document.createElement('div');
    renderRankStream(node, linesPayload(), new FilterStore());
    const rows = node.querySelectorAll<HTMLElement>('.jp-monarch-rs-body > .jp-monarch-rs-line');
    expect(rows).toHaveLength(5);
    expect(rows[1].dataset.rank).toBe('0');
    expect(rows[1].style.borderLeftColor).toBe('var(--jp-monarch-rank-0)');
    expect(rows[2].style.borderLeftColor).toBe('var(--jp-monarch-rank-1)');
    expect(rows[3].classList.contains('jp-mod-stderr')).toBe(true);
    expect(rows[1].textContent).toBe('[0]loss 0.5');
  });
});

describe('folded lines', () => {
  it('shows a line of several ranks once, with its ranks, and expands per rank', () => {
    const node = document.createElement('div');
    renderRankStream(node, linesPayload(), new FilterStore());
    const folded = node.querySelector<HTMLElement>('.jp-mod-folded')!;
    expect(folded.querySelector('.jp-monarch-rs-tag')!.textContent).toBe('[0-3]');
    expect(folded.querySelectorAll('.jp-monarch-rs-dot')).toHaveLength(4);
    const body = folded.querySelector<HTMLElement>('.jp-monarch-rs-expanded')!;
    expect(body.hidden).toBe(true);
    const head = folded.querySelector<HTMLElement>('.jp-monarch-rs-folded-head')!;
    head.click();
    expect(body.hidden).toBe(false);
    expect(head.getAttribute('aria-expanded')).toBe('true');
    const subs = body.querySelectorAll<HTMLElement>('.jp-monarch-rs-line');
    expect(Array.from(subs).map(s => s.textContent)).toEqual([
      '[0]epoch 1', '[1]epoch 1', '[2]epoch 1', '[3]epoch 1'
    ]);
    head.dispatchEvent(new KeyboardEvent('keydown', { key: 'Enter' }));
    expect(body.hidden).toBe(true);
  });

  it('merges identical lines of other ranks, keeping each rank its own order', () => {
    expect(
      foldLines([
        { ranks: [2, 3], stream: 'stdout', text: 'x' },
        { ranks: [2], stream: 'stdout', text: 'y' },
        { ranks: [0, 1], stream: 'stdout', text: 'x' }, // joins [2, 3]: 0 and 1 printed nothing between
        { ranks: [1], stream: 'stdout', text: 'x' }, // 1 printed x already: a line of its own
        { ranks: [0], stream: 'stdout', text: 'y' }, // joins [2] y: 0 printed x before, above it
        { ranks: [3], stream: 'stderr', text: 'x' } // another stream
      ])
    ).toEqual([
      { ranks: [0, 1, 2, 3], stream: 'stdout', text: 'x' },
      { ranks: [0, 2], stream: 'stdout', text: 'y' },
      { ranks: [1], stream: 'stdout', text: 'x' },
      { ranks: [3], stream: 'stderr', text: 'x' }
    ]);
  });

  it('writes ranks as people do', () => {
    expect(compactRanks([3, 0, 1, 2, 5, 7, 8])).toBe('0-3, 5, 7-8');
    expect(compactRanks([4])).toBe('4');
  });
});

describe('rank filter', () => {
  it('shows one rank, then a set, then all again; folded lines follow', () => {
    const store = new FilterStore();
    const node = document.createElement('div');
    renderRankStream(node, linesPayload(), store);
    const chips = node.querySelectorAll<HTMLButtonElement>('.jp-monarch-rs-chip');
    expect(Array.from(chips).map(c => c.textContent)).toEqual(['All', '0', '1', '2', '3']);
    chips[2].click(); // rank 1 only
    expect(visible(node).map(r => r.dataset.ranks)).toEqual(['0,1,2,3', '1']);
    expect(node.querySelector('.jp-mod-folded .jp-monarch-rs-tag')!.textContent).toBe('[1]');
    expect(visible(node, '.jp-monarch-rs-dot').map(d => d.dataset.rank)).toEqual(['1']);
    expect(chips[2].getAttribute('aria-pressed')).toBe('true');
    expect(chips[0].getAttribute('aria-pressed')).toBe('false');
    chips[4].click(); // and rank 3
    expect(visible(node).map(r => r.dataset.ranks)).toEqual(['0,1,2,3', '1', '3']);
    expect(node.dataset.filter).toBe('1, 3');
    chips[2].click();
    chips[4].click(); // none left: all again
    expect(visible(node)).toHaveLength(5);
    chips[3].click();
    chips[0].click(); // All
    expect(visible(node)).toHaveLength(5);
    expect(node.dataset.filter).toBe('all');
  });

  it('applies to every part of the same cell, not to other cells', () => {
    const store = new FilterStore();
    const head = document.createElement('div');
    const later = document.createElement('div');
    const other = document.createElement('div');
    renderRankStream(head, linesPayload(0), store);
    const stop = renderRankStream(later, linesPayload(1), store);
    renderRankStream(other, linesPayload(0, 'c2'), store);
    expect(later.querySelector('.jp-monarch-rs-toolbar')).toBeNull();
    head.querySelector<HTMLButtonElement>('.jp-monarch-rs-chip[data-rank="2"]')!.click();
    expect(visible(later).map(r => r.dataset.ranks)).toEqual(['0,1,2,3', '2']);
    expect(visible(other)).toHaveLength(5);
    // a part rendered after the choice starts filtered
    const late = document.createElement('div');
    renderRankStream(late, linesPayload(2), store);
    expect(visible(late)).toHaveLength(2);
    stop();
    store.set('c1', null);
    expect(visible(later)).toHaveLength(2); // stopped listening
    expect(visible(head)).toHaveLength(5);
  });

  it('hides the rank lines of an expanded folded line outside the selection', () => {
    const node = document.createElement('div');
    renderRankStream(node, linesPayload(), new FilterStore());
    applyFilter(node, new Set([0, 2]));
    const subs = node.querySelectorAll<HTMLElement>('.jp-monarch-rs-expanded > .jp-monarch-rs-line');
    expect(Array.from(subs).filter(s => !s.hidden).map(s => s.dataset.rank)).toEqual(['0', '2']);
  });
});

describe('progress bars', () => {
  it('are grouped one per rank and ordered by rank, whatever the arrival order', () => {
    const node = document.createElement('div');
    renderRankStream(
      node,
      {
        version: 1, cell: 'p', part: 1, ranks: RANKS,
        progress: [
          { rank: 3, stream: 'stderr', text: '40%|####' },
          { rank: 0, stream: 'stderr', text: '90%|#########' },
          { rank: 2, stream: 'stderr', text: '10%|#', done: true },
          { rank: 1, stream: 'stderr', text: '50%|#####' }
        ]
      },
      new FilterStore()
    );
    const bars = node.querySelectorAll<HTMLElement>('.jp-monarch-rs-bar');
    expect(Array.from(bars).map(b => b.dataset.rank)).toEqual(['0', '1', '2', '3']);
    expect(bars[2].classList.contains('jp-mod-done')).toBe(true);
    expect(bars[0].style.borderLeftColor).toBe('var(--jp-monarch-rank-0)');
  });
});

describe('parsePayload', () => {
  it('turns malformed data into an empty part instead of throwing', () => {
    const node = document.createElement('div');
    renderRankStream(node, 'not an object', new FilterStore());
    expect(node.querySelectorAll('.jp-monarch-rs-line')).toHaveLength(0);
    expect(parsePayload({ lines: [null, { ranks: 'x', text: 5 }] }).lines).toEqual([
      { ranks: [], stream: 'stdout', text: '5' }
    ]);
  });

  it('replaces the previous content when rendered again (update_display_data)', () => {
    const node = document.createElement('div');
    const store = new FilterStore();
    const stop = renderRankStream(node, linesPayload(), store);
    stop();
    renderRankStream(node, { ...linesPayload(), lines: [{ ranks: [0], stream: 'stdout', text: 'x' }] }, store);
    expect(node.querySelectorAll('.jp-monarch-rs-body > .jp-monarch-rs-line')).toHaveLength(1);
    expect(node.querySelectorAll('.jp-monarch-rs-toolbar')).toHaveLength(1);
  });
});
