"""The floor every layer stands on: errors, the console, tag names, bounds, scores, output checks and the command-line plumbing."""
