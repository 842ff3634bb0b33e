import '../test/domShims';
import { Widget } from '@lumino/widgets';
import { describe, expect, it } from 'vitest';
import { DashboardRenderer, IRendererSource } from './dashboardRenderer';
import { DASHBOARD_MIME, WIDGET_VIEW_MIME } from './snapshot';

const SNAPSHOT =
  '<div class="monarch-dashboard-view" data-status="snapshot"><table>' +
  '<tr class="mk-row mk-r0"><td class="mk-cpu">12%</td></tr></table></div>';
const LIVE =
  '<div class="monarch-dashboard"><div class="monarch-dashboard-view" data-status="live">' +
  'live</div></div>';

/** ipywidgets' widget-view renderer, as far as the dashboard renderer sees it. */
class FakeWidgetRenderer extends Widget {
  constructor(private outcome: 'live' | 'missing' | 'pending') {
    super();
  }
  async renderModel(): Promise<void> {
    this.node.textContent =
      this.outcome === 'pending' ? 'Loading widget...' : '';
    if (this.outcome === 'missing') {
      this.node.textContent = 'Error displaying widget: model not found';
    } else if (this.outcome === 'live') {
      this.node.innerHTML = LIVE;
    }
  }
}

function setup(outcome: 'live' | 'missing' | 'pending', factory = true) {
  const made: FakeWidgetRenderer[] = [];
  const registry: IRendererSource = {
    getFactory: mt => (factory && mt === WIDGET_VIEW_MIME ? ({} as any) : undefined),
    createRenderer: () => {
      const r = new FakeWidgetRenderer(outcome);
      made.push(r);
      return r as any;
    }
  };
  const renderer = new DashboardRenderer(
    { sanitizer: { sanitize: (h: string) => h } } as any,
    registry
  );
  return { renderer, made };
}

function model(id = 'abc', html = SNAPSHOT) {
  const view = { model_id: id, version_major: 2, version_minor: 0 };
  return {
    trusted: true,
    data: { [DASHBOARD_MIME]: view, [WIDGET_VIEW_MIME]: view, 'text/html': html },
    metadata: {},
    setData: () => undefined
  } as any;
}

const tick = () => new Promise(resolve => setTimeout(resolve, 0));
const snapshotShown = (r: DashboardRenderer) =>
  !r.node.querySelector('.jp-MonarchDashboard-snapshot')!.classList.contains('lm-mod-hidden');

describe('DashboardRenderer', () => {
  it('keeps the static snapshot when the widget model is gone', async () => {
    const { renderer } = setup('missing');
    await renderer.renderModel(model());
    expect(renderer.node.dataset.showing).toBe('snapshot');
    expect(snapshotShown(renderer)).toBe(true);
    expect(renderer.node.querySelector('.mk-row.mk-r0 .mk-cpu')!.textContent).toBe('12%');
  });

  it('shows the snapshot while the widget is still loading', async () => {
    const { renderer } = setup('pending');
    await renderer.renderModel(model());
    expect(renderer.node.dataset.showing).toBe('snapshot');
  });

  it('swaps in the live widget when it renders, and back when it goes', async () => {
    const { renderer, made } = setup('live');
    await renderer.renderModel(model());
    expect(renderer.node.dataset.showing).toBe('live');
    expect(snapshotShown(renderer)).toBe(false);
    made[0].node.textContent = ''; // the view was closed (the widget's comm closed)
    await tick();
    expect(renderer.node.dataset.showing).toBe('snapshot');
    expect(snapshotShown(renderer)).toBe(true);
  });

  it('keeps the live widget when only the HTML changes (a save)', async () => {
    const { renderer, made } = setup('live');
    await renderer.renderModel(model());
    await renderer.renderModel(model('abc', SNAPSHOT.replace('12%', '13%')));
    expect(made).toHaveLength(1);
    expect(renderer.node.dataset.showing).toBe('live');
    expect(renderer.node.querySelector('.jp-MonarchDashboard-snapshot')!.textContent)
      .toContain('13%');
  });

  it('shows the snapshot where no widget renderer exists', async () => {
    const { renderer, made } = setup('live', false);
    await renderer.renderModel(model());
    expect(made).toHaveLength(0);
    expect(renderer.node.dataset.showing).toBe('snapshot');
  });
});
