"""Prediction: simulated ranks on one device and the transfer model of each fabric."""
