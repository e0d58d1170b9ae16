"""Helpers shared by the test suites: tiny random models, and paged batches to run them on."""
