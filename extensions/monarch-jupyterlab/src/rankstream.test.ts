import { describe, expect, it } from 'vitest';
import { renderRankStream } from './rankstream';

describe('renderRankStream', () => {
  it('renders one line per rank entry', () => {
    const node = document.createElement('div');
    renderRankStream(node, [{ rank: 0, text: 'a' }, { rank: 1, text: 'b' }]);
    expect(node.children).toHaveLength(2);
  });
});
