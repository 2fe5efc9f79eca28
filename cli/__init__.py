"""The moet-cache command line: a thin typer layer over the moet_cache library (installed as moet_cache.cli)."""
