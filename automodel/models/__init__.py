"""automodel.models"""
