"""The demos behind `elastic demo` and `elastic chaos`."""
