"""The `tierzero` command line: the only package that prints."""
