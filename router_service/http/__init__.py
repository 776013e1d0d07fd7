"""OpenAI-style HTTP: request models and the FastAPI app."""
