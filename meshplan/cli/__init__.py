"""What the CLI (`cli.py`) parses and shows: click options and parsers (`options`), tables
(`render`), a pipeline's schedule drawn (`timeline`). The Python API (`meshplan`) needs none of it."""
