"""The closed world the synthetic corpus draws from: shared by generator and tokenizer."""

from __future__ import annotations

COUNT_WORDS = ("one", "two", "three", "four")
SIZES = ("small", "large")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 190),
    "orange": (245, 140, 30),
}
SHAPES = ("circle", "square", "triangle", "diamond")
# Cells of a 3 x 3 grid, (row, column), in reading order, with the phrase a caption uses.
POSITIONS: dict[tuple[int, int], str] = {
    (0, 0): "at the top left",
    (0, 1): "at the top",
    (0, 2): "at the top right",
    (1, 0): "at the left",
    (1, 1): "in the center",
    (1, 2): "at the right",
    (2, 0): "at the bottom left",
    (2, 1): "at the bottom",
    (2, 2): "at the bottom right",
}
MAX_SHAPES = len(COUNT_WORDS)
