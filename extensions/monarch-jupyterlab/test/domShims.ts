// What jsdom lacks and Lumino's modules touch when they load (import this first).
const g = globalThis as any;
if (typeof g.DragEvent === 'undefined') {
  g.DragEvent = class DragEvent extends g.MouseEvent {};
}
export {};
