// Unit tests of the pure DOM modules (src/*.test.ts) under jsdom; no JupyterLab at test time.
import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    environment: 'jsdom',
    include: ['src/**/*.test.ts']
  }
});
