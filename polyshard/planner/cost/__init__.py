"""Cost model: compute per op, communication per mesh axis and link class, and their overlap."""
