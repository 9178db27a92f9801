"""The tools: verify, diff, export, conversion of Equinox files, the CLI and the demo."""
