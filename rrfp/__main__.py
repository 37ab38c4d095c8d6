from rrfp.app.cli.main import entry

entry()
