"""The publishers' networks, weight layouts and file formats, read without their frameworks:
facenet-pytorch's Inception-ResNet-v1 and MobileFaceNet_Pytorch's network with their weight
ports, davidsandberg/facenet's TensorFlow graphs and checkpoints, insightface ``.bin`` sets."""
