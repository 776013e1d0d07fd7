"""Offline routing work, never on the serving path: prequential evaluation of the expert predictors."""
