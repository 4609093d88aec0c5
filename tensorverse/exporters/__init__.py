"""Exporters: Prometheus metrics (`metrics`), Parquet/JSONL tables (`export`); see docs/metrics.md."""
