"""TorchServe's archives (.mar and their other forms, .war workflows), their
configuration and versions, and where TorchServe's three APIs listen."""
