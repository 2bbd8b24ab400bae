"""The Jinja2 templates codegen renders, shipped as package data (``codegen.templates``)."""
