"""The job configuration: typed sections (schema), their checks, parsing from YAML and flags."""
