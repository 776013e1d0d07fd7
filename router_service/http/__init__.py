"""OpenAI-style HTTP: request models, request handling over a Router, and the FastAPI app."""
