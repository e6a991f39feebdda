"""The foundations every layer uses: atomic, durable writes and reads (`io`), the logger with a
rank prefix (`log`), versioned documents (`documents`: the base every hand-off between stages is
typed with), and config sections (`section`)."""
