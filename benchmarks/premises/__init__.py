"""Whether a ground holds the premises the trainers' claims need."""
