"""Tools: what `dsc info` and `dsc verify` (`inspect_dataset`), `dsc show` (`sheet`) and `dsc bench`
(`bench`) compute; the command line (`dsc.cli`) prints it."""
