"""Converters from public data sets, as a user downloads them, to the recipes' data format."""
