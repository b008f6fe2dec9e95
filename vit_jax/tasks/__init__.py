"""Objectives beside classification: masked patch prediction."""
