"""Model families of the recipe, one folder each; ``recipes/families.py`` registers them."""
