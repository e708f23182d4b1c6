"""Command-line tools (``fastaf-tune``)."""
