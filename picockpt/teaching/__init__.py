"""What serves the lessons: notebooks.py (each lesson's source made an executed notebook), reproduce.py (every
lesson as one run), plotting.py (the figures)."""
