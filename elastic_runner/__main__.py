from elastic_runner.cli.main import entry

entry()
