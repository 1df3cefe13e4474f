"""automodel.data"""
