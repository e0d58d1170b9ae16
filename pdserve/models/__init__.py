"""The model zoo: layers, model classes, the architecture registry and the weight loaders."""
