import { describe, expect, it } from 'vitest';
import { asSaved, liveHtml, renderStatic, widgetOutcome } from './snapshot';

const VIEW =
  '<div class="monarch-dashboard-view" data-status="live"><span class="mk-status">' +
  'live, every 1 s, 10:00:00</span><table><tr class="mk-row mk-r0"><td class="mk-cpu">' +
  '12%</td></tr></table></div>';

describe('widgetOutcome', () => {
  it('tells a live view, a failure and a pending render apart', () => {
    const node = document.createElement('div');
    node.textContent = 'Loading widget...';
    expect(widgetOutcome(node)).toBe('pending');
    node.textContent = 'Error displaying widget: model not found';
    expect(widgetOutcome(node)).toBe('failed');
    node.innerHTML = `<div class="widget-vbox monarch-dashboard">${VIEW}</div>`;
    expect(widgetOutcome(node)).toBe('live');
  });
});

describe('renderStatic', () => {
  it('shows the snapshot HTML, sanitized when asked', () => {
    const node = document.createElement('div');
    node.textContent = 'old';
    expect(renderStatic(node, VIEW, h => h.replace('12%', '13%'))).toBe(true);
    expect(node.querySelector('.mk-row.mk-r0 .mk-cpu')!.textContent).toBe('13%');
    expect(renderStatic(node, undefined)).toBe(false);
    expect(node.textContent).toBe('');
  });
});

describe('liveHtml and asSaved', () => {
  it('takes the drawing of the live widget and says it was saved while live', () => {
    const node = document.createElement('div');
    node.innerHTML = `<div class="monarch-dashboard">${VIEW}</div>`;
    const html = liveHtml(node)!;
    expect(html.startsWith('<div class="monarch-dashboard-view"')).toBe(true);
    const saved = asSaved(html, new Date(2026, 0, 1, 12, 34, 56));
    expect(saved).toContain('data-status="saved"');
    expect(saved).toContain('last state seen at 12:34:56 (saved while live)');
    expect(saved).not.toContain('live, every');
    expect(liveHtml(document.createElement('div'))).toBeNull();
  });
});
