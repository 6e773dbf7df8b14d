"""Tools around the readers: converters (Criteo, CSV, transcoding) and generators (synthetic
data, CSV for a feature spec)."""
