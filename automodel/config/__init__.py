"""automodel.config"""
