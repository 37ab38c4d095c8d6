from rrfp.app.cli import entry

entry()
