"""Users' files: reading what `ppqa ingest` takes (`inputs`) and writing what `ppqa export`
writes (`export`). The store beside it holds SQL only."""
