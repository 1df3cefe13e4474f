"""automodel.training"""
